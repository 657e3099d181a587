package idempotency

import (
	"context"
	"time"

	"google.golang.org/protobuf/proto"
)

// WithoutSQLCheck turns off the check of a handler's SQL for transaction
// control (txControl), for tests that prove the key's guarantee does not
// depend on it: whatever gets past the check must still leave the key
// settled, never run twice.
func WithoutSQLCheck() StoreOption {
	return func(o *storeOptions) { o.noSQLCheck = true }
}

// SetHTTPClientWait makes c call wait for each of its waits between
// attempts, instead of sleeping, so that a test sees the waits Do chose.
func SetHTTPClientWait(c *HTTPClient, wait func(ctx context.Context, d time.Duration) error) {
	c.wait = wait
}

// SleepContext is the wait HTTPClient uses by default.
var SleepContext = sleepContext

// RequestDigest is what the keys a call derives know of its proto request.
func RequestDigest(req proto.Message) [32]byte {
	return requestDigest(req, defaultDerivedKeyVersion)
}

// PreviousHTTPFingerprint is the fingerprint an HTTP request had before
// the host and a form's fields were part of it.
func PreviousHTTPFingerprint(method, target string, body []byte) []byte {
	return tagged(kindDigest("http request"), []byte(method), []byte(target), body)
}
