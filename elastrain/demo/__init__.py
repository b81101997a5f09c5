"""The demo job: a small GPT on the Python standard library's own source."""
