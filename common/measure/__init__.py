"""Measuring honestly: step timers, peak memory, energy, the profiler, GPU peak throughput and the floors
a step cannot beat."""
