"""Worker runtime: the elastic trainer and the step protocol."""
