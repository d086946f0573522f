"""Process concerns every recipe shares: run control (the run lock, stop signals, Slurm requeue,
task-file checks, save schedule), the watcher that ends a run's processes however it ends
(``reaper``), and the console (logging, progress, third-party notices filtered)."""
