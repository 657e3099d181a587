package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// A request sent from a goroutine the handler left behind, redirected
// (307) after the handler returned: http.Client makes the next hop a new
// request with the ended call's context, and HTTPTransport refuses it with
// ErrCallEnded, nothing sent. (It failed when the redirect's key was
// looked up first.)
func TestHTTPTransportRefusesARedirectHopAfterTheCallEnded(t *testing.T) {
	t.Parallel()
	p := startProvider(t)
	arrived, release := make(chan struct{}), newGate()
	old := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(arrived)
		_ = release.wait(r.Context())
		http.Redirect(w, r, p.url+r.URL.Path, http.StatusTemporaryRedirect)
	}))
	t.Cleanup(old.Close)
	t.Cleanup(release.open)
	store := migratedStore(t, testdb.New(t, 2))
	client := &http.Client{Transport: &idempotency.HTTPTransport{}}
	done := make(chan error, 1)
	_, err := store.Execute(context.Background(), idempotency.Call{Key: "order-4", Method: "m"}, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		go func() {
			_, err := post(idempotency.WithEffect(ctx, "charge"), client, http.MethodPost, old.URL+"/v1/charges", "charge")
			done <- err
		}()
		<-arrived // the request went out while the call ran
		return nil, nil
	})
	require.NoError(t, err)
	release.open() // the call has ended: now the old address redirects
	err = await(t, done, "the goroutine's request")
	require.Empty(t, p.headers.all(), "the hop made after the call ended was sent")
	require.ErrorIs(t, err, idempotency.ErrCallEnded)
}
