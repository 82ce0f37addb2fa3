"""The bytes a daemon moves: engines' shared-memory files and CUDA IPC handles, the regions
mapped from them, the staging pool, and the copies between regions and staging (the native
run copy, two slots in flight)."""
