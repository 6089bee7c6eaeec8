"""Where a process runs: the device, the CPU cores it may use, the launcher and process group, rank
placement, a description of the machine, the environment check."""
