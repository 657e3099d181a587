package payments_test

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/examples/payments"
	paymentsv1 "github.com/exactlyonce/idempotency/examples/payments/proto/payments/v1"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

func newService(t *testing.T) (paymentsv1.PaymentServiceClient, *testdb.DB) {
	t.Helper()
	db := testdb.New(t, 16)
	ctx := context.Background()
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	require.NoError(t, payments.Migrate(ctx, db.Pool, store))
	require.NoError(t, payments.Migrate(ctx, db.Pool, store), "migrating twice is harmless")
	return newServiceOn(t, db, store)
}

// newServiceOn serves gRPC on an existing database and store.
func newServiceOn(t *testing.T, db *testdb.DB, store *idempotency.Store) (paymentsv1.PaymentServiceClient, *testdb.DB) {
	t.Helper()
	srv := payments.NewGRPCServer(payments.NewServer(db.Pool), store)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient("passthrough:///"+lis.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return paymentsv1.NewPaymentServiceClient(conn), db
}

func TestChargeKeepsARunningBalance(t *testing.T) {
	t.Parallel()
	c, _ := newService(t)
	ctx := context.Background()
	ids := map[string]bool{}
	for i, want := range []int64{100, 350, 375} {
		resp, err := c.Charge(ctx, &paymentsv1.ChargeRequest{AccountId: "a", AmountCents: []int64{100, 250, 25}[i]})
		require.NoError(t, err)
		require.Equal(t, want, resp.GetBalanceCents(), "balance after charge %d", i)
		require.Equal(t, "a", resp.GetAccountId())
		require.False(t, ids[resp.GetChargeId()], "charge IDs are unique per executed charge")
		ids[resp.GetChargeId()] = true
	}
	bal, err := c.GetBalance(ctx, &paymentsv1.GetBalanceRequest{AccountId: "a"})
	require.NoError(t, err)
	require.EqualValues(t, 375, bal.GetBalanceCents())
	require.EqualValues(t, 3, bal.GetCharges())

	empty, err := c.GetBalance(ctx, &paymentsv1.GetBalanceRequest{AccountId: "nobody"})
	require.NoError(t, err)
	require.Zero(t, empty.GetBalanceCents())
	require.Zero(t, empty.GetCharges())
}

func TestChargeWithTheSameKeyChargesOnce(t *testing.T) {
	t.Parallel()
	c, db := newService(t)
	ctx := idempotency.WithOutgoingKey(context.Background(), "order-1001")
	var wg sync.WaitGroup
	resps := make([]*paymentsv1.ChargeResponse, 10)
	for i := range resps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			resps[i], err = c.Charge(ctx, &paymentsv1.ChargeRequest{AccountId: "b", AmountCents: 500})
			require.NoError(t, err)
		}()
	}
	wg.Wait()
	for _, r := range resps {
		require.Equal(t, resps[0].GetChargeId(), r.GetChargeId(), "every sender gets the one charge")
	}
	bal, charges, err := payments.Balance(context.Background(), db.Pool, "b")
	require.NoError(t, err)
	require.EqualValues(t, 500, bal)
	require.EqualValues(t, 1, charges)

	_, err = c.Charge(ctx, &paymentsv1.ChargeRequest{AccountId: "b", AmountCents: 900})
	require.Equal(t, codes.FailedPrecondition, status.Code(err), "the key belongs to the 500 charge")
}

// A charge that fails validation is not stored: as with Stripe, the
// corrected request can be sent with the same key.
func TestInvalidChargeReleasesItsKey(t *testing.T) {
	t.Parallel()
	c, db := newService(t)
	for i, req := range []*paymentsv1.ChargeRequest{
		{AccountId: "c", AmountCents: 0},
		{AccountId: "c", AmountCents: -5},
		{AccountId: "", AmountCents: 5},
	} {
		ctx := idempotency.WithOutgoingKey(context.Background(), fmt.Sprintf("bad-%d", i))
		var tr metadata.MD
		_, err := c.Charge(ctx, req, grpc.Trailer(&tr))
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", req)
		require.False(t, idempotency.IsKeyReused(err) || strings.Contains(err.Error(), "idempotency"), "the handler's own error: %v", err)
		require.Empty(t, tr.Get(idempotency.ReplayedTrailer))

		fixed := &paymentsv1.ChargeRequest{AccountId: "c", AmountCents: 7}
		resp, err := c.Charge(ctx, fixed)
		require.NoError(t, err, "the corrected request, same key")
		_, err = c.Charge(ctx, fixed, grpc.Trailer(&tr))
		require.NoError(t, err)
		require.Equal(t, []string{"true"}, tr.Get(idempotency.ReplayedTrailer), "and its retry replays")
		require.Equal(t, "c", resp.GetAccountId())
	}
	require.Equal(t, 3, db.Count(t, `SELECT count(*) FROM ledger`), "one charge per corrected request")
}

func TestChargeRequiresAKey(t *testing.T) {
	t.Parallel()
	// A client without the key interceptor shows what the server's method
	// options enforce.
	db := testdb.New(t, 4)
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	require.NoError(t, payments.Migrate(context.Background(), db.Pool, store))
	srv := payments.NewGRPCServer(payments.NewServer(db.Pool), store)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	raw := paymentsv1.NewPaymentServiceClient(conn)

	_, err = raw.Charge(context.Background(), &paymentsv1.ChargeRequest{AccountId: "d", AmountCents: 1})
	require.Equal(t, codes.InvalidArgument, status.Code(err), "Charge is MODE_REQUIRED")
	_, err = raw.GetBalance(context.Background(), &paymentsv1.GetBalanceRequest{AccountId: "d"})
	require.NoError(t, err, "GetBalance is NO_SIDE_EFFECTS and needs no key")
}
