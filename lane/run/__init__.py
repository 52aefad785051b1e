"""Running: a plan's launches on the numpy backend (inside one arena buffer) or on CuPy, the constants they load,
and the step functions generation calls. Stands on `lower`."""
