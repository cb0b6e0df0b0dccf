"""Running a study's trials: the invocation, the driver and its workers, each trial's objective and record,
checkpoints, and the tables printed."""
