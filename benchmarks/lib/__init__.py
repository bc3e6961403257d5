"""What the benchmark scripts share: ``config`` (the tiny Llama, resized; process counts), ``timeline`` (one job
launched and read back; process-seconds, committed tokens, progress), ``report`` (statistics, JSON, Markdown),
``record`` (one JSON record per run: command, commit, machine, dates, samples, figures; ``benchmarks/pages.py``
builds the figures pages from them).

``benchmarks/vs_torchft.py`` adds: ``tiny_llama`` (the same model, sample stream and optimizer in plain PyTorch,
for the peer systems), ``torchft_worker`` / ``torchft_runner`` (plain DDP and torchft under torchrun),
``recover_runner`` (ReCoVer through the launcher, relaunched on exit 3), ``outside_faults`` (SIGKILLs by pid at a
step or a time, the same for every system) and ``side_by_side`` (the numbers compared)."""
