package idempotency_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// Unimplemented is not final: during a rolling deploy a replica that has the
// new method's stub but not its implementation answers Unimplemented; the
// retry, reaching a replica that implements it, must run the handler rather
// than replay the stub's answer for the key's TTL.
func TestPolicyUnimplementedDuringRollingDeployIsRetried(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	createLedger(t, db)
	icpt := grpc.UnaryInterceptor(idempotency.UnaryServerInterceptor(store))

	old := grpc.NewServer(icpt)
	testingv1.RegisterPolicyServiceServer(old, testingv1.UnimplementedPolicyServiceServer{})
	updated := grpc.NewServer(icpt)
	testingv1.RegisterPolicyServiceServer(updated, &policyServer{db: db})
	oldClient := testingv1.NewPolicyServiceClient(dial(t, serve(t, old)))
	newClient := testingv1.NewPolicyServiceClient(dial(t, serve(t, updated)))

	req := &testingv1.Request{Body: "rolling"}
	_, _, err := send(oldClient.Required, "rolling-key", req)
	require.Equal(t, codes.Unimplemented, status.Code(err), "%v", err)
	require.Equal(t, 0, db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'rolling-key'`), "the key is released")

	resp, replayed, err := send(newClient.Required, "rolling-key", req)
	require.NoError(t, err)
	require.False(t, replayed)
	require.NotZero(t, resp.GetLedgerId())
	again, replayed, err := send(newClient.Required, "rolling-key", req)
	require.NoError(t, err)
	require.True(t, replayed)
	require.Equal(t, resp.GetLedgerId(), again.GetLedgerId())
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger WHERE note = 'rolling'`))
	require.NotContains(t, idempotency.DefaultFinalCodes(), codes.Unimplemented)
}
