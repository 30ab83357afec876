"""The runtime: the parallel module each rank trains, and its gradient synchronisation."""
