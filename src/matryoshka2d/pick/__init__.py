"""Pick a (cell, backend) for a budget: cost as served, quality as served, one frontier."""
