package idempotency_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/exactlyonce/idempotency/internal/testdb"
)

// A deploy between a crash and its re-run: the client sends the same
// bytes, with a field the old build does not know set explicitly to zero
// (a client whose schema gives it presence, proto3 optional or proto2).
// The old build keeps it as an unknown field, the new build declares it
// without presence and drops the zero when it re-encodes the request. The
// engine counts both as the same request (the stored result replays across
// the deploy), but the derived keys differ: the provider charges twice.
func TestReview2DeployDroppingAnExplicitZeroChangesDerivedKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	amount := review2Field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false)
	oldSchema := review2Schema(t, "proto3", amount)
	newSchema := review2Schema(t, "proto3", amount, review2Field("fee", 2, descriptorpb.FieldDescriptorProto_TYPE_INT64, false))
	var oldKeys, newKeys keyLog
	oldBuild := review2PayServer(t, store, oldSchema, &oldKeys, crashes)
	newBuild := review2PayServer(t, store, newSchema, &newKeys, nil)
	body := varintField(varintField(nil, 1, 500), 2, 0) // amount=500, fee=0 sent explicitly

	// The engine's view: the request is the same across the deploy.
	okOld := review2PayServer(t, store, oldSchema, &keyLog{}, nil)
	first := sendRaw(okOld, "stored-1", body)
	require.NoError(t, first.err)
	requireReplayOf(t, first, sendRaw(newBuild, "stored-1", body), "the same request across the deploy")

	require.Equal(t, codes.Unavailable, status.Code(sendRaw(oldBuild, "order-7", body).err), "the old build crashes after charging")
	require.NoError(t, sendRaw(newBuild, "order-7", body).err, "the new build runs the call again")
	require.Equal(t, oldKeys.all(), newKeys.all(), "the re-run after the deploy must send the provider the key the first run sent")
}
