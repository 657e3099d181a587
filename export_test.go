package idempotency

// WithoutSQLCheck turns off the check of a handler's SQL for transaction
// control (txControl), for tests that prove the key's guarantee does not
// depend on it: whatever gets past the check must still leave the key
// settled, never run twice.
func WithoutSQLCheck() StoreOption {
	return func(o *storeOptions) { o.noSQLCheck = true }
}
