"""Reusable recipe pieces: config, data, loop, optimizer, checkpoint/resume (import the submodules directly)."""
