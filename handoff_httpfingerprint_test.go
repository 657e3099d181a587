package idempotency_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
)

// A row the release before stored (HTTP fingerprint version 4: the body's
// digest of its raw bytes). It failed when no version 5 fingerprint was
// compared with it: a request with another body under its key got the
// stored response of the first (an order of 999 answered with the receipt
// of 100), for the key's whole TTL after the upgrade. Version 5 keeps the
// body's bytes digest beside its canonical JSON's: a byte-identical retry
// replays, another body is 422.
func TestHTTPVersionFourRowIsComparedAsBefore(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	store := migratedStore(t, db)
	var runs atomic.Int64
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, "run %d", n)
	})))
	t.Cleanup(srv.Close)
	first := `{"amount":100}`
	r1 := sendJSON(t, srv, "k-v4", "application/json", first)
	require.Equal(t, http.StatusCreated, r1.status, r1.body)

	// Make the stored row what version 4 stored for the same request.
	raw := sha256.Sum256([]byte(first))
	// Version 5's magic, version, request and flags (flag 4 cleared), then
	// the body's bytes digest: version 4's layout.
	tag, err := db.Pool.Exec(context.Background(), `UPDATE idempotency_keys SET fingerprint =
  set_byte(set_byte(substring(fingerprint from 1 for 38), 4, 4), 37, get_byte(fingerprint, 37) & 3) || $1::bytea
WHERE key = 'http k-v4'`, raw[:])
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())

	same := sendJSON(t, srv, "k-v4", "application/json", first)
	require.Equal(t, "true", same.header.Get(idempotency.ReplayedHeader), "the byte-identical retry replays")
	other := sendJSON(t, srv, "k-v4", "application/json", `{"amount":999}`)
	require.NotEqual(t, "true", other.header.Get(idempotency.ReplayedHeader), "another body got the stored response %q", other.body)
	require.Equal(t, http.StatusUnprocessableEntity, other.status)
	require.EqualValues(t, 1, runs.Load())
}
