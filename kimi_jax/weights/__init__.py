"""Checkpoint I/O: hub-layout safetensors (read and write) and Orbax snapshots of converted parameters."""
