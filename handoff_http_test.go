package idempotency_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// An HTTP response compressed by the handler replays with its
// Content-Encoding, readable; a cookie it set is neither replayed nor
// stored.
func TestHTTPReplayKeepsContentEncodingAndNoCookie(t *testing.T) {
	t.Parallel()
	var compressed bytes.Buffer
	zw := gzip.NewWriter(&compressed)
	_, _ = zw.Write([]byte(`{"charged":true}`))
	require.NoError(t, zw.Close())
	e := newHTTPEnv(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "gzip")
		http.SetCookie(w, &http.Cookie{Name: "session", Value: "first-callers-secret"})
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(compressed.Bytes())
	})
	for i := 0; i < 2; i++ {
		req, err := http.NewRequest(http.MethodPost, e.srv.URL+"/v1/charges", strings.NewReader("x"))
		require.NoError(t, err)
		req.Header.Set(idempotency.HeaderKey, "k")
		resp, err := e.srv.Client().Do(req) // decompresses what says gzip
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, `{"charged":true}`, string(body), "attempt %d", i)
		require.Equal(t, i == 1, resp.Header.Get(idempotency.ReplayedHeader) == "true")
		if i == 1 {
			require.Empty(t, resp.Cookies(), "the first caller's cookie is not replayed")
		}
	}
	require.EqualValues(t, 1, e.runs.Load())
	rec, err := e.store.Inspect(context.Background(), "", "k")
	require.NoError(t, err)
	require.NotContains(t, string(rec.Metadata), "first-callers-secret", "nor stored")
}

// The HTTP middleware stores a handler's final answer as a response (its
// status, headers and body), and an error of the engine's as a problem
// document: the first caller and every replay get the same bytes.
func TestFinalHTTPAnswersEveryCallerAlike(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		handler http.HandlerFunc
		code    int
	}{
		{name: "the handler's own 4xx", code: http.StatusPaymentRequired, handler: func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("X-Decline-Code", "insufficient_funds")
			w.WriteHeader(http.StatusPaymentRequired)
			_, _ = io.WriteString(w, `{"error":"card declined"}`)
		}},
		{name: "an error of the engine's, stored", code: http.StatusInternalServerError, handler: func(w http.ResponseWriter, r *http.Request) {
			tx := idempotency.MustTxFromContext(r.Context())
			_, _ = tx.Exec(r.Context(), `COMMIT`) // refused, and the call fails, stored
			w.WriteHeader(http.StatusCreated)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			store := migratedStore(t, testdb.New(t, 4))
			var runs atomic.Int64
			srv := httptest.NewServer(idempotency.HTTPMiddleware(store, idempotency.WithHTTPReplayedHeaders("X-Decline-Code"))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				tc.handler(w, r)
			})))
			t.Cleanup(srv.Close)
			send := func() (int, http.Header, []byte) {
				req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/charges", strings.NewReader(`{"amount":1}`))
				require.NoError(t, err)
				req.Header.Set(idempotency.HeaderKey, "k")
				resp, err := http.DefaultClient.Do(req)
				require.NoError(t, err)
				defer resp.Body.Close()
				body, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				h := resp.Header.Clone()
				h.Del("Date")
				return resp.StatusCode, h, body
			}
			code1, h1, body1 := send()
			code2, h2, body2 := send()
			require.Equal(t, tc.code, code1, "%s", body1)
			require.Equal(t, code1, code2)
			require.Equal(t, string(body1), string(body2), "the replay's body is the first's")
			require.Equal(t, []string{"true"}, h2.Values(idempotency.ReplayedHeader), "the replay says so")
			h2.Del(idempotency.ReplayedHeader)
			keys := func(h http.Header) []string {
				k := slices.Collect(func(yield func(string) bool) {
					for name := range h {
						if !yield(name) {
							return
						}
					}
				})
				slices.Sort(k)
				return k
			}
			require.Equal(t, keys(h1), keys(h2))
			require.Equal(t, h1, h2, "the replay's headers are the first's")
			require.EqualValues(t, 1, runs.Load())
		})
	}
}
