"""Checkpoints that survive a kill: one file written atomically, or a sharded folder (DCP) that resumes
on another world size."""
