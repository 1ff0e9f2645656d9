"""lightgate."""
