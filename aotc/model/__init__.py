"""The model a manifest names: built as its own loader builds it, called by name."""
