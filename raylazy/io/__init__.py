"""Readers of a plan, without Ray: one rank's plan executed in any process (`backends.read_rank`), by positional
reads (`ranged`), through a node's page cache (`cooperative`), by stripes exchanged over a process group of the
node's ranks (`exchange`, over `collective`), or by fastsafetensors (`fst`)."""
