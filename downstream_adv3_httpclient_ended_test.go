package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// A goroutine the handler left running calls Do; its first attempt gets a
// 503 after the handler returned. Do sends no retry under the key it
// derived for the ended call: ErrCallEnded, as HTTPTransport refuses a
// redirect hop then. (It failed when the retry was sent.)
func TestHTTPClientSendsNoRetryAfterTheCallEnded(t *testing.T) {
	t.Parallel()
	arrived, release := make(chan struct{}), newGate()
	var mu sync.Mutex
	var keys []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		keys = append(keys, r.Header.Get(idempotency.HeaderKey))
		n := len(keys)
		mu.Unlock()
		if n == 1 {
			close(arrived)
			_ = release.wait(r.Context())
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(release.open)
	store := migratedStore(t, testdb.New(t, 2))
	hc := &idempotency.HTTPClient{BackoffBase: time.Millisecond, BackoffMax: time.Millisecond}
	done := make(chan error, 1)
	_, err := store.Execute(context.Background(), idempotency.Call{Key: "order-5", Method: "m"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		go func() {
			req, err := http.NewRequestWithContext(idempotency.WithEffect(ctx, "charge"), http.MethodPost, srv.URL+"/v1/charges", strings.NewReader("charge"))
			if err != nil {
				done <- err
				return
			}
			resp, err := hc.Do(req)
			if resp != nil {
				_ = resp.Body.Close()
			}
			done <- err
		}()
		<-arrived // the first attempt went out while the call ran
		return nil, nil
	})
	require.NoError(t, err)
	release.open() // the call has ended: now the first attempt fails
	err = await(t, done, "the goroutine's Do")
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, keys, 1, "an attempt made after the call ended was sent with the derived key %q", keys[0])
	require.ErrorIs(t, err, idempotency.ErrCallEnded)
}
