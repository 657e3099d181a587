package idempotency_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
)

// A 503 with Retry-After 2 whose body trickles, under a 3 s budget: the
// body is drained during the wait and cut when it ends, so Do is not held
// past its budget. (It failed when the drain came before the whole wait,
// and Do returned after 4 s.)
func TestHTTPClientSlowDrainStaysWithinTheBudget(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	var requests atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if requests.Add(1) == 1 {
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte("overloaded, details follow"))
			w.(http.Flusher).Flush()
			select {
			case <-release:
			case <-r.Context().Done():
			}
			return
		}
		_, _ = w.Write([]byte("ok"))
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) })

	budget := 3 * time.Second
	hc := &idempotency.HTTPClient{Budget: budget, BackoffBase: 10 * time.Millisecond}
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/charges", strings.NewReader("charge"))
	require.NoError(t, err)
	start := time.Now()
	resp, err := hc.Do(req)
	took := time.Since(start)
	if resp != nil {
		_ = resp.Body.Close()
	}
	t.Logf("Do returned after %v (budget %v): %v", took.Round(time.Millisecond), budget, err)
	require.Less(t, took, budget+500*time.Millisecond, "Do overran its budget")
}
