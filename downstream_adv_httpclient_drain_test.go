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

// HTTPClient's Budget bounds the whole Do: a server that answers 503 (or
// 409, 429) and then never finishes the response's body cannot hold Do in
// the drain of that body before the retry. (It failed when nothing bounded
// the drain.)
func TestHTTPClientBudgetBoundsTheDrainOfARetriedResponse(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	var requests atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if requests.Add(1) == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte("overloaded, details follow"))
			w.(http.Flusher).Flush()
			select { // the rest of the body never comes while the test waits
			case <-release:
			case <-r.Context().Done():
			}
			return
		}
		_, _ = w.Write([]byte("ok"))
	}))
	t.Cleanup(srv.Close)

	hc := &idempotency.HTTPClient{Budget: 300 * time.Millisecond, BackoffBase: 10 * time.Millisecond}
	type outcome struct {
		resp *http.Response
		err  error
	}
	done := make(chan outcome, 1)
	start := time.Now()
	go func() {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/charges", strings.NewReader("charge"))
		if err != nil {
			done <- outcome{err: err}
			return
		}
		resp, err := hc.Do(req)
		done <- outcome{resp, err}
	}()
	t.Cleanup(func() { // let Do finish, so that the test leaks nothing
		close(release)
		o := <-done
		if o.resp != nil {
			_ = o.resp.Body.Close()
		}
	})
	select {
	case o := <-done:
		done <- o
		require.Less(t, time.Since(start), 3*time.Second)
	case <-time.After(3 * time.Second):
		t.Fatalf("Do with a budget of %v still running after %v: held by the drain of a retried response's body", hc.Budget, time.Since(start).Round(time.Millisecond))
	}
}
