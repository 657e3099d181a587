package idempotency_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// net/http lets a caller reuse a request once the response's body is
// closed. A handler that reuses one for another endpoint (a refund after a
// charge) gets a key of the refund's own: the transport remembers the
// target with the pointer. (It failed when the refund carried the charge's
// key, which the provider refused as reused, and the refund never
// happened.)
func TestHTTPTransportReusedRequestForAnotherTargetGetsItsOwnKey(t *testing.T) {
	t.Parallel()
	p := startProvider(t)
	store := migratedStore(t, testdb.New(t, 2))
	client := &http.Client{Transport: &idempotency.HTTPTransport{}}
	var codes []int
	_, err := store.Execute(context.Background(), idempotency.Call{Key: "order-3", Method: "m"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url+"/v1/charges", strings.NewReader("charge 5"))
		require.NoError(t, err)
		for _, next := range []struct{ path, body string }{{"/v1/charges", "charge 5"}, {"/v1/refunds", "refund 5"}} {
			req.URL.Path = next.path
			req.Body, req.ContentLength = io.NopCloser(strings.NewReader(next.body)), int64(len(next.body))
			req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(strings.NewReader(next.body)), nil }
			resp, err := client.Do(req)
			if err != nil {
				return nil, err
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			codes = append(codes, resp.StatusCode)
		}
		return nil, nil
	})
	require.NoError(t, err)
	h := p.headers.all()
	require.Len(t, h, 2)
	require.NotEqual(t, h[0], h[1], "a charge and a refund are two effects: two keys")
	require.Equal(t, []int{http.StatusOK, http.StatusOK}, codes)
	require.EqualValues(t, 2, p.execs.Load())
}
