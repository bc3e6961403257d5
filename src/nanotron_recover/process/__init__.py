"""A rank's process: the start-up guard, the start-up watchdog and the end of a whole job, the fault injector."""
