"""GPUs: which one each worker trains on, the memory promised on each, and the planner of b and k for a budget."""
