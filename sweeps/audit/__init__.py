"""The audit: a user's script run at (b, k) and at (b*k, 1) from the same start, and the mistakes that part them."""
