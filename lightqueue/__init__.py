"""lightqueue."""
