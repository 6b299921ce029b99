"""Everything a config names, checked before any process starts: files and models, user hooks."""
