"""HTTP routes, thin: parse the body, build a job, format what the worker returns."""
