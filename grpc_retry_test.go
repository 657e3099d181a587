package idempotency_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// heldNaturalKey serves the annotated test service; its NaturalKey handler
// (key_field meta.request_id) signals entered and waits for release.
type heldNaturalKey struct {
	policyServer
	entered chan struct{}
	release *gate
}

func (s *heldNaturalKey) NaturalKey(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	s.entered <- struct{}{}
	if err := s.release.wait(ctx); err != nil {
		return nil, err
	}
	return s.write(ctx, r)
}

// The ready chain retries a call whose key is in its request (key_field)
// like one whose key is in the metadata: a duplicate that meets the first
// call still running gets KEY_IN_PROGRESS, waits the chain's backoff and
// the server's RetryInfo, and is answered with the first call's result.
func TestGRPCNaturalKeyDuplicateIsRetriedByTheChain(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	store := migratedStore(t, db, idempotency.WithInProgressWait(10*time.Millisecond), idempotency.WithSuggestedRetryDelay(20*time.Millisecond))
	createLedger(t, db)
	h := &heldNaturalKey{policyServer: policyServer{db: db}, entered: make(chan struct{}, 8), release: newGate()}
	srv := grpc.NewServer(grpc.UnaryInterceptor(idempotency.UnaryServerInterceptor(store)))
	testingv1.RegisterPolicyServiceServer(srv, h)
	conn, log := retryingClient(t, "passthrough:///"+serve(t, srv), 50)
	client := testingv1.NewPolicyServiceClient(conn)

	req := &testingv1.Request{Body: "natural", Meta: &testingv1.Meta{RequestId: "nk-1"}}
	type answer struct {
		resp     *testingv1.Response
		err      error
		replayed bool
	}
	answers := make([]answer, 2)
	var wg sync.WaitGroup
	call := func(i int) {
		var tr metadata.MD
		resp, err := client.NaturalKey(context.Background(), req, grpc.Trailer(&tr))
		answers[i] = answer{resp, err, len(tr.Get(idempotency.ReplayedTrailer)) > 0}
	}
	wg.Go(func() { call(0) })
	await(t, h.entered, "the first call's handler")
	wg.Go(func() { call(1) })
	require.Eventually(t, func() bool {
		log.mu.Lock()
		defer log.mu.Unlock()
		return log.codes[codes.Aborted] > 0
	}, liveness, time.Millisecond, "the duplicate meets the running call")
	time.Sleep(100 * time.Millisecond) // a few retries of the duplicate while the first runs
	h.release.open()
	wg.Wait()

	for i, a := range answers {
		require.NoError(t, a.err, "call %d", i)
	}
	require.Equal(t, answers[0].resp.GetLedgerId(), answers[1].resp.GetLedgerId())
	require.False(t, answers[0].replayed)
	require.True(t, answers[1].replayed, "the duplicate is answered from the store")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
	log.requireOnlyFailures(t, codes.Aborted)
}
