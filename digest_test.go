package idempotency_test

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The keys a gRPC request derives for its downstream calls, end to end: a
// retry that the request comparison calls the same request, sent another
// way, derives the keys its first run sent.

// It failed when the request's digest hashed what the comparison does not
// compare: a run that derived its effect's key and failed with
// Unavailable (the key released), then its retry with a double sent as -0
// instead of 0, with an optional field set to its default instead of
// unset, or with an Any's type URL under another prefix (each the same
// request to the comparison: a third send of the first encoding replays
// the retry's answer) derived another key, and a provider charged again.
func TestGRPCRetryOfTheSameRequestDerivesTheSameKeys(t *testing.T) {
	t.Parallel()
	const double, int64Kind, message = descriptorpb.FieldDescriptorProto_TYPE_DOUBLE, descriptorpb.FieldDescriptorProto_TYPE_INT64, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE
	md := paySchema(t, "proto3", []payField{
		{name: "amount", number: 1, kind: int64Kind},
		{name: "rate", number: 2, kind: double},
		{name: "tip", number: 3, kind: int64Kind, optional: true},
		{name: "rates", number: 4, kind: double},
		{name: "detail", number: 5, kind: message, typeName: ".google.protobuf.Any"},
		{name: "share", number: 6, kind: double, optional: true},
	}, false, "google/protobuf/any.proto")
	fixed64 := func(num protowire.Number, v float64) []byte {
		return protowire.AppendFixed64(protowire.AppendTag(nil, num, protowire.Fixed64Type), math.Float64bits(v))
	}
	negZero := math.Copysign(0, -1)
	amount := slices.Clip(varintField(nil, 1, 250)) // appended to by several cases
	detail := func(url string) []byte {
		v, err := proto.Marshal(wrapperspb.String("order-77"))
		require.NoError(t, err)
		return bytesField(amount, 5, bytesField(bytesField(nil, 1, []byte(url)), 2, v))
	}
	for _, c := range []struct {
		name         string
		first, retry []byte
	}{
		{"a double sent as -0, then not at all (0)", append(fixed64(2, negZero), amount...), amount},
		{"an optional double sent as -0, then as 0", append(fixed64(6, negZero), amount...), append(fixed64(6, 0), amount...)},
		{"an optional field sent as its default, then unset", varintField(amount, 3, 0), amount},
		{"an Any's type URL under another prefix", detail("type.googleapis.com/google.protobuf.StringValue"), detail("example.com/google.protobuf.StringValue")},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			store := migratedStore(t, suiteDB(t))
			var mu sync.Mutex
			var sent []string
			conn := servePay(t, store, md, func(ctx context.Context, _ proto.Message) (any, error) {
				k, ok := idempotency.EffectKey(ctx, "charge order-77")
				require.True(t, ok)
				mu.Lock()
				defer mu.Unlock()
				sent = append(sent, k)
				if len(sent) == 1 {
					return nil, status.Error(codes.Unavailable, "the provider charged; the answer is lost")
				}
				return wrapperspb.String(fmt.Sprintf("run %d", len(sent))), nil
			})
			first := sendRaw(conn, "order-77", c.first)
			require.Equal(t, codes.Unavailable, status.Code(first.err), "%v", first.err)
			retry := sendRaw(conn, "order-77", c.retry)
			require.NoError(t, retry.err)
			again := sendRaw(conn, "order-77", c.first)
			requireReplayOf(t, retry, again, "the first encoding: the same request")
			require.Len(t, sent, 2)
			require.Equal(t, sent[0], sent[1], "the retry of the same request derived another key")
		})
	}
}

// What the request digest of derived keys makes of a request: two
// different requests must never derive the same keys, and one request sent
// byte for byte again, across a deploy, must derive the same.

// digestSchema builds idempotency.test.PayRequest of one release from
// field declarations (each a separate build: nothing is registered).
func digestSchema(t *testing.T, syntax string, fields ...*descriptorpb.FieldDescriptorProto) protoreflect.MessageDescriptor {
	t.Helper()
	msg := &descriptorpb.DescriptorProto{Name: proto.String("PayRequest"), Field: fields}
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("idempotency/test/pay.proto"), Package: proto.String("idempotency.test"),
		Syntax: proto.String(syntax), MessageType: []*descriptorpb.DescriptorProto{msg},
	}, protoregistry.GlobalFiles)
	require.NoError(t, err)
	return fd.Messages().Get(0)
}

func digestField(name string, number int32, kind descriptorpb.FieldDescriptorProto_Type, repeated bool) *descriptorpb.FieldDescriptorProto {
	label := descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL
	if repeated {
		label = descriptorpb.FieldDescriptorProto_LABEL_REPEATED
	}
	return &descriptorpb.FieldDescriptorProto{
		Name: proto.String(name), Number: proto.Int32(number), Type: kind.Enum(), Label: label.Enum(), JsonName: proto.String(name),
	}
}

// digestPayServer serves methodPay with requests decoded as md on store;
// the handler records the key of the effect "charge", then answers with
// fail(req) when it is not nil, else succeeds.
func digestPayServer(t *testing.T, store *idempotency.Store, md protoreflect.MessageDescriptor, keys *keyLog, fail func(proto.Message) error) *grpc.ClientConn {
	t.Helper()
	return servePay(t, store, md, func(ctx context.Context, req proto.Message) (any, error) {
		k, ok := idempotency.EffectKey(ctx, "charge")
		if !ok {
			return nil, status.Error(codes.Internal, "no running call")
		}
		keys.add(k)
		if fail != nil {
			if err := fail(req); err != nil {
				return nil, err
			}
		}
		return wrapperspb.String("charged"), nil
	})
}

// crashes is a handler outcome that releases the key after the charge went
// out: the process "died" before its commit.
func crashes(proto.Message) error {
	return status.Error(codes.Unavailable, "the process dies after charging, before its commit")
}

// A corrected request that only reorders a repeated field (the order in
// which recipients are paid, line items, steps) is another request to the
// engine, and sent again under a released key it runs as another
// operation: its derived keys differ from the first request's. (It failed
// when the digest sorted a list's elements like a message's fields, and
// the provider deduplicated the corrected operation into the first.)
func TestReorderedRepeatedFieldDerivesOtherKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	md := digestSchema(t, "proto3", digestField("recipients", 1, descriptorpb.FieldDescriptorProto_TYPE_STRING, true))
	var keys keyLog
	conn := digestPayServer(t, store, md, &keys, func(req proto.Message) error {
		// The first recipient's request is the one that fails here.
		if req.ProtoReflect().Get(md.Fields().ByName("recipients")).List().Get(0).String() == "alice" {
			return crashes(req)
		}
		return nil
	})
	ab := bytesField(bytesField(nil, 1, []byte("alice")), 1, []byte("bob"))
	ba := bytesField(bytesField(nil, 1, []byte("bob")), 1, []byte("alice"))

	// The engine tells the two orders apart: a stored result under one
	// key refuses the other order.
	require.NoError(t, sendRaw(conn, "stored-1", ba).err)
	requireKeyReused(t, sendRaw(conn, "stored-1", ab), "the other order is another request to the engine")

	require.Equal(t, codes.Unavailable, status.Code(sendRaw(conn, "order-1", ab).err))
	require.NoError(t, sendRaw(conn, "order-1", ba).err, "the corrected request runs under the released key")
	k := keys.all()
	require.Len(t, k, 3, "the refused request ran nothing")
	require.NotEqual(t, k[1], k[2], "a corrected request (recipients reordered) is another operation: it must not send the first one's key")
}

// A string (or bytes) field whose content happens to parse as protobuf
// fields is hashed as bytes: "MangoEagle" and "EagleMango" (each two
// fixed32 fields, tags 'M' and 'E') derive different keys, as the engine
// tells the two requests apart. (It failed when such content was sorted
// like a message.)
func TestStringsThatParseAsMessagesDeriveOtherKeys(t *testing.T) {
	t.Parallel()
	var runs sync.Map
	var keys keyLog
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		k, _ := idempotency.EffectKey(ctx, "charge")
		keys.add(k)
		if _, again := runs.LoadOrStore(req.GetValue(), true); !again && req.GetValue() == "MangoEagle" {
			return nil, status.Error(codes.Unavailable, "the first run dies after charging")
		}
		return req, nil
	}})
	ctx := context.Background()
	require.NoError(t, e.call(ctx, methodCharge, "stored-1", "EagleMango").err)
	requireKeyReused(t, e.call(ctx, methodCharge, "stored-1", "MangoEagle"), "the engine tells the two strings apart")

	require.Equal(t, codes.Unavailable, status.Code(e.call(ctx, methodCharge, "order-1", "MangoEagle").err))
	require.NoError(t, e.call(ctx, methodCharge, "order-1", "EagleMango").err, "another request under the released key")
	k := keys.all()
	require.Len(t, k, 3, "the refused request ran nothing")
	require.NotEqual(t, k[1], k[2], "two different requests (\"MangoEagle\", \"EagleMango\") must not derive the same downstream key")
}

// A message field numbered 14 (its tag byte is 0x72) followed by another
// field, and one raw field whose bytes start the same: two requests the
// engine tells apart. The digest hashes a canonical encoding of the
// request with nothing added, so they derive different keys. (It failed
// when the digest marked raw fields with 'r', 0x72: a pair was found in
// about 44,000 hashes.)
func TestDigestOfAMessageFieldNeverCollidesWithARawField(t *testing.T) {
	t.Parallel()
	blob := digestField("blob", 1, descriptorpb.FieldDescriptorProto_TYPE_BYTES, false)
	sub := digestField("sub", 14, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, false)
	sub.TypeName = proto.String(".google.protobuf.Int64Value")
	pad := digestField("pad", 15, descriptorpb.FieldDescriptorProto_TYPE_BYTES, false)
	md := digestSchemaWith(t, []string{"google/protobuf/wrappers.proto"}, blob, sub, pad)

	// A sum that reads as the tag of field 1 (bytes) and a length of 107.
	var n int64
	var sum [32]byte
	for n = 1; ; n++ {
		sum = idempotency.RequestDigest(wrapperspb.Int64(n))
		if sum[0] == 0x0a && sum[1] == 107 {
			break
		}
		require.Less(t, n, int64(50_000_000), "no sum found")
	}
	subBytes, err := proto.Marshal(wrapperspb.Int64(n))
	require.NoError(t, err)
	padField := bytesField(nil, 15, bytes.Repeat([]byte{'p'}, 73)) // 75 bytes
	require.Len(t, padField, 75)
	first := append(bytesField(nil, 14, subBytes), padField...) // {sub: n, pad: "ppp..."}
	second := bytesField(nil, 1, append(append(append([]byte(nil), sum[2:]...), 'r', byte(len(padField))), padField...))

	decode := func(b []byte) *dynamicpb.Message {
		m := dynamicpb.NewMessage(md)
		require.NoError(t, proto.Unmarshal(b, m))
		return m
	}
	a, b := decode(first), decode(second)
	require.False(t, proto.Equal(a, b), "two different requests")
	fa, _ := idempotency.Fingerprint(methodPay, a)
	fb, _ := idempotency.Fingerprint(methodPay, b)
	require.NotEqual(t, fa, fb, "the engine tells them apart")

	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	// Under a stored result, the second request is another request.
	var stored keyLog
	ok := digestPayServer(t, store, md, &stored, nil)
	require.NoError(t, sendRaw(ok, "order-kept", first).err)
	requireKeyReused(t, sendRaw(ok, "order-kept", second), "the second request under the first's stored result")

	// Under a released key, it runs as another operation: its downstream
	// keys must be its own.
	var keys keyLog
	conn := digestPayServer(t, store, md, &keys, crashes)
	require.Equal(t, codes.Unavailable, status.Code(sendRaw(conn, "order-1", first).err))
	require.Equal(t, codes.Unavailable, status.Code(sendRaw(conn, "order-1", second).err))
	k := keys.all()
	require.Len(t, k, 2)
	require.NotEqual(t, k[0], k[1], "two requests the engine tells apart derive the same downstream key (sub=%d)", n)
}

// requireAnyPairDerivesOtherKeys sends two requests {amount: 500, extra: Any packing typeURL
// with value a (then b)}: first under a stored result (the engine must
// tell them apart: KEY_REUSED), then under a released key (the second runs
// as another operation: its downstream key must be its own).
func requireAnyPairDerivesOtherKeys(t *testing.T, typeURL string, a, b []byte) {
	t.Helper()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	amount := digestField("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false)
	anyField := digestField("extra", 4, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, false)
	anyField.TypeName = proto.String(".google.protobuf.Any")
	md := digestSchemaWith(t, []string{"google/protobuf/any.proto"}, amount, anyField)
	encode := func(v []byte) []byte {
		return bytesField(varintField(nil, 1, 500), 4, bytesField(bytesField(nil, 1, []byte(typeURL)), 2, v))
	}
	var stored keyLog
	kept := digestPayServer(t, store, md, &stored, nil)
	require.NoError(t, sendRaw(kept, "order-kept", encode(a)).err)
	requireKeyReused(t, sendRaw(kept, "order-kept", encode(b)), "another packed message under the first's stored result")

	var keys keyLog
	conn := digestPayServer(t, store, md, &keys, crashes)
	require.Equal(t, codes.Unavailable, status.Code(sendRaw(conn, "order-1", encode(a)).err))
	require.Equal(t, codes.Unavailable, status.Code(sendRaw(conn, "order-1", encode(b)).err))
	k := keys.all()
	require.Len(t, k, 2)
	require.NotEqual(t, k[0], k[1], "two requests the engine tells apart derive the same downstream key")
}

// A google.protobuf.Value packed in an Any, sent as [number 1][string "x"]
// (the string is set) and the other way round (the number is): two
// requests, two sets of keys, as the packed message is decoded and encoded
// again. (It failed when its fields were sorted as they came.)
func TestOneofOrderInsideAnAnyDerivesOtherKeys(t *testing.T) {
	t.Parallel()
	num := protowire.AppendFixed64(protowire.AppendTag(nil, 2, protowire.Fixed64Type), math.Float64bits(1))
	str := bytesField(nil, 3, []byte("x"))
	a := append(append([]byte(nil), num...), str...)
	b := append(append([]byte(nil), str...), num...)
	va, vb := &structpb.Value{}, &structpb.Value{}
	require.NoError(t, proto.Unmarshal(a, va))
	require.NoError(t, proto.Unmarshal(b, vb))
	require.Equal(t, "x", va.GetStringValue())
	require.Equal(t, 1.0, vb.GetNumberValue())
	requireAnyPairDerivesOtherKeys(t, "type.googleapis.com/google.protobuf.Value", a, b)
}

// A Struct packed in an Any, sent as [k:1][k:2] (it holds k=2) and as
// [k:2][k:1] (k=1): two requests. The packed message is decoded and
// encoded again, the last entry winning as in any decoder, so they derive
// different keys. (It failed when entries were sorted as bytes.)
func TestDuplicateMapKeyInsideAnAnyDerivesOtherKeys(t *testing.T) {
	t.Parallel()
	entry := func(v float64) []byte {
		val := protowire.AppendFixed64(protowire.AppendTag(nil, 2, protowire.Fixed64Type), math.Float64bits(v))
		return bytesField(nil, 1, bytesField(bytesField(nil, 1, []byte("k")), 2, val))
	}
	a := append(entry(1), entry(2)...)
	b := append(entry(2), entry(1)...)
	sa, sb := &structpb.Struct{}, &structpb.Struct{}
	require.NoError(t, proto.Unmarshal(a, sa))
	require.NoError(t, proto.Unmarshal(b, sb))
	require.Equal(t, 2.0, sa.GetFields()["k"].GetNumberValue())
	require.Equal(t, 1.0, sb.GetFields()["k"].GetNumberValue())
	requireAnyPairDerivesOtherKeys(t, "type.googleapis.com/google.protobuf.Struct", a, b)
}

// The most common deploy: a newer client already sends a message field
// (google.protobuf.Int64Value tip = 2) that the build it reaches does not
// declare yet; the call crashes after charging, and its re-run reaches the
// new build, which declares the field. The declared field's canonical
// encoding is the bytes the old build held as unknown: the re-run derives
// the key the first run sent. (It failed when a declared message was
// hashed as its sum and an unknown one as its bytes.)
func TestDeployDeclaringAMessageFieldKeepsTheKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	amount := digestField("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false)
	tip := digestField("tip", 2, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, false)
	tip.TypeName = proto.String(".google.protobuf.Int64Value")
	oldMd := digestSchema(t, "proto3", amount)
	newMd := digestSchemaWith(t, []string{"google/protobuf/wrappers.proto"}, amount, tip)

	var oldKeys, newKeys keyLog
	oldConn := digestPayServer(t, store, oldMd, &oldKeys, crashes)
	newConn := digestPayServer(t, store, newMd, &newKeys, crashes)
	tipBytes, err := proto.Marshal(wrapperspb.Int64(100))
	require.NoError(t, err)
	body := bytesField(varintField(nil, 1, 500), 2, tipBytes)

	require.Equal(t, codes.Unavailable, status.Code(sendRaw(oldConn, "order-1", body).err))
	require.Equal(t, codes.Unavailable, status.Code(sendRaw(newConn, "order-1", body).err))
	require.Len(t, oldKeys.all(), 1)
	require.Len(t, newKeys.all(), 1)
	require.Equal(t, oldKeys.all()[0], newKeys.all()[0],
		"the build that declares the message field derives another key than the build that held it as unknown sent")
}

// The request's digest is taken before the handler runs: a handler that
// charges from 16 goroutines while it fills in a field of its request
// does not race with the library (run with -race). (It failed when the
// first key derived read the live request.)
func TestEffectKeyIgnoresWritesToTheRequest(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		var wg sync.WaitGroup
		for i := range 16 {
			wg.Go(func() { idempotency.EffectKey(ctx, fmt.Sprintf("charge item-%d", i)) })
		}
		req.Value = "normalised" // the handler's own field, written while its goroutines charge
		wg.Wait()
		return req, nil
	}})
	require.NoError(t, e.call(context.Background(), methodCharge, "order-2", "raw").err)
}

// Derived keys "depend on the running call's operation and on nothing the
// handler does". The request digest is taken lazily, at the first key a
// run derives, from the request object the handler holds, so what the
// handler does to its request before then changes the keys.

// A handler that scrubs its request before charging (it swaps the card
// number for a vault token, a new one on each run) derives the same key
// for its named effect on its re-run: the provider charges once. (It
// failed when the digest read the request the handler had changed.)
func TestHandlerRewritingItsRequestKeepsItsEffectKeys(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	var keys keyLog
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		run := runs.Add(1)
		req.Value = fmt.Sprintf("tok_%d", run) // the card number, replaced by this run's vault token
		k, ok := idempotency.EffectKey(ctx, "charge")
		require.True(t, ok)
		keys.add(k)
		if run == 1 {
			return nil, status.Error(codes.Unavailable, "the first run dies after charging")
		}
		return req, nil
	}})
	ctx := context.Background()
	require.Equal(t, codes.Unavailable, status.Code(e.call(ctx, methodCharge, "order-1", "4242424242424242").err))
	require.NoError(t, e.call(ctx, methodCharge, "order-1", "4242424242424242").err)
	k := keys.all()
	require.Len(t, k, 2)
	require.Equal(t, k[0], k[1], "the same operation (same key, method, request as sent) must send the same key for one named effect, whatever the handler did to its request object")
}

// A request's map entries in any order and an Any whose packed message
// (its type linked in) has its fields in another order: one request, one
// set of keys.
func TestMapAndAnyOrderKeepTheKeys(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	amount := digestField("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false)
	anyField := digestField("extra", 4, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, false)
	anyField.TypeName = proto.String(".google.protobuf.Any")
	md := digestSchemaWith(t, []string{"google/protobuf/any.proto"}, amount, anyField)
	oldMd := digestSchema(t, "proto3", amount)
	var keys, oldKeys keyLog
	conn := digestPayServer(t, store, md, &keys, crashes)
	oldConn := digestPayServer(t, store, oldMd, &oldKeys, crashes)

	entries := make([][]byte, 64)
	for i := range entries {
		entries[i] = bytesField(nil, 1, append(bytesField(nil, 1, []byte(fmt.Sprintf("k%02d", i))),
			bytesField(nil, 2, bytesField(nil, 3, []byte(fmt.Sprintf("v%02d", i))))...)) // Struct.fields entry {key: Value{string_value}}
	}
	inner := func(order []int) []byte {
		var b []byte
		for _, i := range order {
			b = append(b, entries[i]...)
		}
		return b
	}
	encode := func(order []int, innerFirst bool) []byte {
		st := inner(order)
		var anyBytes []byte
		if innerFirst {
			anyBytes = bytesField(bytesField(nil, 2, st), 1, []byte("type.googleapis.com/google.protobuf.Struct"))
		} else {
			anyBytes = bytesField(bytesField(nil, 1, []byte("type.googleapis.com/google.protobuf.Struct")), 2, st)
		}
		return varintField(bytesField(nil, 4, anyBytes), 1, 500)
	}
	order := rand.Perm(len(entries))
	sorted := make([]int, len(entries))
	for i := range sorted {
		sorted[i] = i
	}
	for _, b := range [][]byte{encode(sorted, false), encode(order, true), encode(rand.Perm(len(entries)), false)} {
		require.Equal(t, codes.Unavailable, status.Code(sendRaw(conn, "order-1", b).err))
		require.Equal(t, codes.Unavailable, status.Code(sendRaw(oldConn, "order-1", b).err))
	}
	k, ok := keys.all(), oldKeys.all()
	require.Equal(t, []string{k[0], k[0], k[0]}, k)
	// A build that does not declare the field holds the Any as unknown
	// bytes, in the client's order, and derives a key per order (a limit,
	// see requestDigest): it is not compared here.
	require.Len(t, ok, 3)

	// The Any decodes as the Struct it packs.
	a := &anypb.Any{Value: inner(order), TypeUrl: "type.googleapis.com/google.protobuf.Struct"}
	st := &structpb.Struct{}
	require.NoError(t, a.UnmarshalTo(st))
	require.Len(t, st.GetFields(), len(entries))
}

// digestSchemaWith is digestSchema in a file with dependencies.
func digestSchemaWith(t *testing.T, deps []string, fields ...*descriptorpb.FieldDescriptorProto) protoreflect.MessageDescriptor {
	t.Helper()
	msg := &descriptorpb.DescriptorProto{Name: proto.String("PayRequest"), Field: fields}
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("idempotency/test/pay.proto"), Package: proto.String("idempotency.test"),
		Syntax: proto.String("proto3"), Dependency: deps, MessageType: []*descriptorpb.DescriptorProto{msg},
	}, protoregistry.GlobalFiles)
	require.NoError(t, err)
	return fd.Messages().Get(0)
}
