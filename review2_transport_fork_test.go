package idempotency_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// HTTPTransport's memory of the requests it sent (the same *http.Request
// resent keeps its counted key), against what net/http does with requests.

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

// A handler that retries its own POST by giving its http.Client the same
// *http.Request again (its body reset from GetBody), as HTTPTransport's
// documentation says keeps its counted key. http.Client hands the
// transport a shallow copy of the request on every Do when the Client has
// a Timeout (as most production clients do), when the URL carries user
// information, or when the request has no Header map, so the transport
// never sees the same pointer twice: the retry takes the next ordinal's
// key, and the provider executes the charge twice.
func TestReview2HTTPTransportResentRequestKeepsItsKeyWhenHTTPClientCopiesIt(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, testdb.New(t, 2))
	for _, tc := range []struct {
		name     string
		timeout  time.Duration
		url      string
		noHeader bool
	}{
		{"plain", 0, "http://provider.invalid/v1/charges", false},
		{"Client.Timeout", 30 * time.Second, "http://provider.invalid/v1/charges", false},
		{"user in the URL", 0, "http://acct_1:sk_test@provider.invalid/v1/charges", false},
		{"no Header map", 0, "http://provider.invalid/v1/charges", true},
	} {
		var keys keyLog
		client := &http.Client{Transport: &idempotency.HTTPTransport{Base: review2Answering(&keys, http.StatusServiceUnavailable)}, Timeout: tc.timeout}
		_, err := store.Execute(context.Background(), idempotency.Call{Key: "order-" + strings.ReplaceAll(tc.name, " ", "-"), Method: "m"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, tc.url, strings.NewReader("charge"))
			require.NoError(t, err)
			if tc.noHeader {
				req.Header = nil
			}
			for range 2 { // the first answer is a 503: the handler sends the same request again
				if req.Body, err = req.GetBody(); err != nil {
					return nil, err
				}
				resp, err := client.Do(req)
				if err != nil {
					return nil, err
				}
				_ = resp.Body.Close()
			}
			return nil, nil
		})
		require.NoError(t, err)
		k := keys.all()
		require.Len(t, k, 2)
		assert.Equal(t, k[0], k[1], "%s: the same *http.Request sent again keeps its key", tc.name)
	}
}
