package idempotency_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The transport's memory of sent requests is weak: a handler that posts
// many large requests (a batch) and drops each after its response does
// not hold their bodies until the call ends. (It failed when the memory
// held every counted request.)
func TestHTTPTransportDoesNotKeepSentRequestsAlive(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, testdb.New(t, 2))
	var keys keyLog
	client := &http.Client{Transport: &idempotency.HTTPTransport{Base: review2Answering(&keys, http.StatusOK)}}
	const n, size = 64, 1 << 20
	var collected atomic.Int64
	_, err := store.Execute(context.Background(), idempotency.Call{Key: "batch-1", Method: "m"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		for range n {
			body := bytes.Repeat([]byte{'x'}, size)
			runtime.AddCleanup(&body[0], func(struct{}) { collected.Add(1) }, struct{}{})
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://provider.invalid/v1/items", bytes.NewReader(body))
			require.NoError(t, err)
			resp, err := client.Do(req)
			if err != nil {
				return nil, err
			}
			_ = resp.Body.Close()
		}
		// Still in the handler: the requests sent are garbage.
		deadline := time.Now().Add(3 * time.Second)
		for collected.Load() < n/2 && time.Now().Before(deadline) {
			runtime.GC()
			time.Sleep(10 * time.Millisecond)
		}
		require.GreaterOrEqual(t, collected.Load(), int64(n/2), "the bodies of requests already answered and dropped (%d MiB) are collectable while the call runs", n*size>>20)
		return nil, nil
	})
	require.NoError(t, err)
	require.Len(t, keys.all(), n)
}

// review2Answering is a Base that reads each request whole, logs its key,
// and answers status.
func review2Answering(keys *keyLog, status int) http.RoundTripper {
	return roundTripFunc(func(r *http.Request) (*http.Response, error) {
		if r.Body != nil {
			_, _ = io.Copy(io.Discard, r.Body)
			_ = r.Body.Close()
		}
		keys.add(r.Header.Get(idempotency.HeaderKey))
		return &http.Response{StatusCode: status, Body: http.NoBody, Header: http.Header{}, Request: r}, nil
	})
}
