"""HTTP routes, all under /api/v1 (the Tinker protocol plus /api/v1/treadle/...)."""
