"""Planning: the plan format, semi-automatic planning, the cost graph, the solvers, the driver."""
