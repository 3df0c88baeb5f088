"""Report rendering: the signed report model and its HTML page."""
