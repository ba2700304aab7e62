"""Keys: the keyring, the admin verbs, limits and budgets (quotas), and a stream's metering."""
