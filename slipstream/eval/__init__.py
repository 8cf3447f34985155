"""Model evaluation: perplexity."""
