"""What the benchmark scripts share: ``config`` (the tiny Llama, resized; process counts), ``timeline`` (one job
launched and read back; process-seconds, committed tokens, progress), ``report`` (statistics, JSON, Markdown)."""
