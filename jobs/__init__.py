"""pylon.jobs: entrypoints that `ray job submit` runs (`python -m pylon.jobs.<name>`) and their loops."""
