"""What both processes share, torch-free: the run directory's contract (rundir, fsutil), config field rules
(schema), the tests' fault switches, GGUF metadata, packaged models, has_gpu, the builtin model's name, tracking,
the console, errors."""
