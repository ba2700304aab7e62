"""The quality watch: shadow checks of what was served, and their store's reader."""
