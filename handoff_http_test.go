package idempotency_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
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
