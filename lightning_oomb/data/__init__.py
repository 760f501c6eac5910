"""Training data that needs more than a token stream: conversations rendered with a chat template."""
