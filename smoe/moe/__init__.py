"""The mixture-of-experts arithmetic every decoder shares: routing and the token->expert loop."""
