"""Lowering: the lane's table, the link of each chosen op to its launches, the shim the engine's extraction weighs,
the schedule, the buffers and the arena, and `plan()`, which joins them. Stands on `engine` and `kernels` only."""
