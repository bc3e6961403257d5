"""``nanotron-recover report``: what happened to a run and what it cost, from its run folder alone.

* :mod:`.records`  reads the run folder (through :mod:`nanotron_recover.run.run_folder`), naming what it cannot read;
* :mod:`.timeline` turns the records into step series and events on the step axis, over every launch (pure);
* :mod:`.summary`  the text summary's numbers and wording (pure);
* :mod:`.figure`   the matplotlib figure, as a PNG or a self-contained HTML page;
* :mod:`.cli`      ``add_report_arguments`` / ``run_report`` for the ``nanotron-recover`` command.
"""
