"""What both processes share, torch-free: the run directory's contract (rundir, fsutil), config field rules
(schema), judges, GGUF metadata, the builtin model's name, tracking, the console, errors."""
