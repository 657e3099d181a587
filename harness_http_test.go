package idempotency_test

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
)

// What the HTTP tests share: a client that sends a request under a key
// and reads the whole response, trailers included, and a POST of a body
// under a Content-Type.

// mountedReply is what a client received, trailers included.
type mountedReply struct {
	status  int
	header  http.Header
	trailer http.Header
	body    string
}

// do sends req with the key and reads the whole response.
func do(t *testing.T, client *http.Client, req *http.Request, key string) mountedReply {
	t.Helper()
	if key != "" {
		req.Header.Set(idempotency.HeaderKey, key)
	}
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return mountedReply{resp.StatusCode, resp.Header, resp.Trailer, string(b)}
}

func mountedPost(t *testing.T, url, contentType, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	return req
}
