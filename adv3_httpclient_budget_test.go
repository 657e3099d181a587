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

// "Budget bounds the whole Do: the waits, and each attempt until its
// response's headers arrive". Do checks that the wait a 503's Retry-After
// asks for fits in the budget before it drains that response's body, and
// not after: a body that trickles is drained for as long as the wait (2 s
// here), then Do waits the whole wait again, past the budget (3 s), only
// to have the next attempt cut at once. Do returns about a second after
// its budget with nothing gained (it could have returned the 503).
func TestAdv3HTTPClientWaitAfterASlowDrainOverrunsTheBudget(t *testing.T) {
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
