"""A study: its data (spec.py), study files and the built-in ones (files.py, builtin/), and its searches."""
