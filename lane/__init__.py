"""The lane: four rooms with one-way imports — `cli` (the command) stands on `explore` and `run`, both stand on
`lower` (the table, link, shim, schedule, arena and `plan()`), which stands on `engine` and `kernels`."""
